"""End-to-end tests: a package, so their helpers import as `e2e.conftest`, a name no other
conftest can take."""
