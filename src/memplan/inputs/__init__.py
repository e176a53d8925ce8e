"""What the user gives: the model (ModelSpec from the catalog, a hub config or a file), the GPU profile, the workload."""
