"""One session in one process, on the event loop: its owner (the runtime), start-up and
shutdown, the stop path, the public faces (ManagedSession, Coordinator), services, signals,
the loop watch and the heartbeat writer."""
