"""NVIDIA's fault-tolerance launcher (nvidia-resiliency-ext's ``ft_launcher``): the trainer's steps as heartbeats.

``ft_launcher`` is torchrun with in-job restarts and hang detection. It starts one rank monitor per worker and
gives the worker its socket (``FT_RANK_MONITOR_IPC_SOCKET``); a monitor watches only a worker that connected to it
through ``RankMonitorClient`` (its documented API), and kills it (SIGCONT, then ``--ft-rank-termination-signal``,
SIGKILL by default) when no heartbeat came for ``--ft-rank-heartbeat-timeout`` seconds (the first one within
``--ft-initial-rank-heartbeat-timeout``), after which the launcher restarts every worker. :class:`Heartbeat`
connects when that socket is given and sends one heartbeat per completed step; otherwise it does nothing, and
nvidia-resiliency-ext is not imported. docs/cluster.md says how to launch with it.
"""
from __future__ import annotations

import os

# set by ft_launcher for each worker (nvidia_resiliency_ext.fault_tolerance.data.FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR)
MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


class Heartbeat:
    """One heartbeat per completed step to this worker's ft_launcher rank monitor, when there is one."""

    def __init__(self):
        self._client = None
        if not os.environ.get(MONITOR_SOCKET_ENV):
            return
        try:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
        except ImportError as error:  # launched by an ft_launcher of another environment
            raise ValueError(f"{MONITOR_SOCKET_ENV} is set (this worker was started by ft_launcher) but "
                             f"nvidia-resiliency-ext does not import here ({error}): install it where the "
                             f"trainer runs, or launch with torchrun") from None
        client = RankMonitorClient()
        client.init_workload_monitoring()
        self._client = client

    def beat(self) -> None:
        if self._client is not None:
            self._client.send_heartbeat()

    def close(self) -> None:
        """Disconnect: the monitor stops watching this worker (it is ending on purpose)."""
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None
