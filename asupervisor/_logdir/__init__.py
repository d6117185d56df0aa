"""What any process reads or writes in a logdir, with or without a session: the store, locks
and leases, checkpoint names and the state file, retention, records, verification, the
heartbeat and ledger formats, and the report `asupervisor inspect` prints."""
