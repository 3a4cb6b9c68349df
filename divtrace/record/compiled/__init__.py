"""Recording torch.compile'd models: taps inside compiled code (taps.py), the per-recording session (session.py),
wrapper-free module paths (paths.py), the kernel that computed a tapped value (kernels.py). What bisect says about
compiled traces is divtrace/compare/compiled_report.py. See docs/compiled.md.

In: a model with torch.compile'd parts and the recorder's module calls. Out: module enter/exit records from
inside compiled code (through the recorder), and meta.json's `compiled` and `unseen` entries."""
