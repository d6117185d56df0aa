"""The sidecar evaluator: a reader of the logdir in a process of its own."""
