"""Fault injection for S3 tests: a proxy that fails requests on purpose."""
