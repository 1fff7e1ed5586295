"""Cost models: FLOP and byte counts (`flops`), the planner's roofline and memory
model (`costmodel`), what this PyTorch runtime keeps in memory (`runtime_memory`), and
measured compute (`compute`). Pure functions of shapes; no process groups, no torch
modules."""
