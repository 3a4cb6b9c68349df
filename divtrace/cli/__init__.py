"""The divtrace command line: one module per command, thin over the library, printing through `output`."""
