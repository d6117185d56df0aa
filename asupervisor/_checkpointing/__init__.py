"""One session's saving machinery: the checkpointer (restore with fallback, sync and async
writes), the object saved, the async snapshot, a non-chief's part in a multi-worker save."""
