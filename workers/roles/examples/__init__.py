"""Example roles written only against the role contract (`docs/roles.md`)."""
