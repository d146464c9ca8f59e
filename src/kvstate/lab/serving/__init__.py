"""Lab drivers for the server's scheduler (``kvstate serve``): benchmarks that run it in-process."""
