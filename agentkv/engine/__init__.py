"""agentkv.engine."""
