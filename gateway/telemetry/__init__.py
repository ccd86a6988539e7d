"""Telemetry store: one durable row per request, in SQLite (embedded default) or PostgreSQL."""
