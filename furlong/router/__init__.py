"""The router: one HTTP address in front of many engine servers.

Load balancing (least in-flight, round robin, session affinity), sticky sessions by
``X-Routing-Key``, health checks with quarantine and re-admission, failover of requests
whose engine died, and fan-out of control calls (pause, abort, weight updates) to every
engine. ``server`` has the details; ``cli`` the command line (``furlong router``).

In process::

    from furlong.router import serve_in_thread
    handle = serve_in_thread(["http://127.0.0.1:30001", "http://127.0.0.1:30002"])
    ...  # talk to handle.url exactly as to one engine
    handle.stop()
"""

from furlong.router.server import Router, RouterHandle, serve_in_thread

__all__ = ["Router", "RouterHandle", "serve_in_thread"]
