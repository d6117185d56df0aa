"""Real-process fault tests: a trainer subprocess, kills, signals and a report."""
