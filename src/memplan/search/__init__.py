"""`suggest`: the space of plans, the cost model that ranks them, the ranking and its explanation."""
