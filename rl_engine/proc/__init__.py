"""Process utilities: what knows only about processes, their environment and file descriptors,
nothing of a run, a config or storage (the lowest floor: every other folder may use them).

    failpoints.py   SIGKILL this process at a named point (RFT_FAILPOINT), for crash tests
    owner_watch.py  processes that exit when the process that started them is gone
    reaper.py       `rft run`'s watcher: nothing it started outlives it
    starts.py       a tally of expensive starts (RFT_COUNT_STARTS), for the test suite's report
    logfile.py      pointing a process's stdout and stderr at a log file (`terminal_to`)
    exits.py        a child's exit code in words (`describe_exit`)
"""
