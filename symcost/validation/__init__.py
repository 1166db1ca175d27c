"""Stage 6, validation: symcost's predictions against PyTorch's own measurements (timed compiled
kernels and steps on this machine). Imports the passes it checks."""
