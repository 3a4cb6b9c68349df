"""Recording torch.compile'd models: taps inside compiled code (taps.py), the per-recording session (session.py),
wrapper-free module paths (paths.py), the kernel that computed a tapped value (kernels.py) and what bisect says
about compiled traces (report.py). See docs/compiled.md."""
