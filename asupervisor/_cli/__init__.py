"""The command lines' parts (`run`, `health`, `evaluate`, `inspect`'s printing); the entry
point is the public `asupervisor.cli`."""
