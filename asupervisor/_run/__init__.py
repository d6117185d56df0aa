"""`asupervisor run`: the process supervisor, and the warm standby's program."""
