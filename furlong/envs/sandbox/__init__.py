"""Sandboxes: where model-written code runs, away from the trainer, the engine and the host.

    base.py      SandboxLimits, the Sandbox contract, what every provider shares
    local.py     LocalSandbox: a limited, isolated child process (the default, `envs.sandbox: local`)
    jail.py      the bwrap (and, as root, setpriv) command line of a local run; the refusal without it
    child.py     the first program inside a local sandbox: rlimits, Landlock, then main.py (stdlib only)
    remote.py    RemoteSandbox: the run protocol of the cloud providers (one machine, one runner per run)
    runner.py    the program a remote machine runs for one job (standard library only)
    e2b.py       E2BSandbox (`envs.sandbox: e2b`)
    daytona.py   DaytonaSandbox (`envs.sandbox: daytona`)
    factory.py   build_sandbox: the provider an `envs` config asks for (or `envs.sandbox_factory`)

Providers import `base` (and `remote`) only; `factory` alone knows them all, and
imports the cloud ones lazily, since their SDKs are an optional extra.
"""
