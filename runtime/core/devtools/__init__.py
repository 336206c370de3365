"""Tools for studying the core without a model: record and replay, state diffs, a synthetic runner."""
