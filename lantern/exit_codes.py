"""Exit codes of every `lantern` command, defined once (the commands' --json objects carry them as "exit_code")."""

EXIT_OK = 0
EXIT_INTERNAL = 1  # lantern's own bug: the message says so, the trace goes to stderr
EXIT_FAILED_CASES = 1  # `profile run`: a measured case failed (recorded with its error); `backends --check`: a
# conformance check failed
EXIT_BAD_INPUT = 2  # bad usage or input, found before any work; nothing written
EXIT_UNAVAILABLE = 3  # a known backend that cannot run on this machine
