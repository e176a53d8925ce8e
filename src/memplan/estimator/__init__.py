"""The memory of a step: byte rules, per-family facts, activation models, parallel states, the step itself."""
