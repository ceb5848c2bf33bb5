"""Stand-ins for SDKs this machine does not have; each one says in its name that it is a fake."""
