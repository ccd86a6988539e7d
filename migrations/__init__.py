"""Alembic migrations of the telemetry store (packaged so `specgate db` finds them when installed)."""
