"""The I/O shell: the engine client, Dynamo's request plane, the monitor loop, the state
holder (Health) and the server lifecycle."""
