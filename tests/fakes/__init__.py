"""Test fakes: stand-ins for outside services, used by the tests only (never shipped in the
product packages). `tests/` is on sys.path under pytest, so they import as `fakes.<module>`."""
