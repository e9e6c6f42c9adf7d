"""A run's lifecycle on storage: context, lease, preflight, lineage, retention, report, timeline, process watchers."""
