"""One agent's NIXL notifications for two owners (the PD side channel's ``pulled:`` and the s3agg client's
``s3agg:``) each reach their own handler through the agent's one dispatcher.

Two real NIXL agents with UCX in this process, as the connector's workers
have; the sender learns the receiver from its metadata and sends over UCX.
"""

from __future__ import annotations

import itertools
import os

from dualpath_connector.protocol import PULLED
from nixl_backends.nixl_io import wait_until
from nixl_backends.notifications import dispatcher_for
from nixl_backends.s3agg_protocol import NOTIFICATION_PREFIX, encode_notification
from nixl_backends.transport import add_ucx_backend

_names = itertools.count()


def _agent():
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"notif-test-{os.getpid()}-{next(_names)}", nixl_agent_config(backends=[]))
    add_ucx_backend(agent)
    return agent


def test_pulled_and_s3agg_notifications_to_one_agent_each_reach_their_handler():
    receiver, sender = _agent(), _agent()
    receiver_name = sender.add_remote_agent(receiver.get_agent_metadata())
    pulled, s3agg = [], []
    dispatcher = dispatcher_for(receiver)
    dispatcher.register(PULLED, pulled.append)
    dispatcher.register(NOTIFICATION_PREFIX.encode(), s3agg.append)
    try:
        expected_s3agg = [encode_notification("req-1", 0), encode_notification("req-1", 1)]
        sent = [PULLED + b"prefill-7", *expected_s3agg, PULLED + b"prefill-8"]
        for message in sent:
            sender.send_notif(receiver_name, message)

        def all_delivered() -> bool:
            dispatcher.poll()  # also progresses UCX on the receiving side
            return len(pulled) + len(s3agg) >= len(sent)

        wait_until(all_delivered, 10.0)
        assert pulled == [PULLED + b"prefill-7", PULLED + b"prefill-8"]
        assert s3agg == expected_s3agg
        # The sender's own dispatcher saw none of them: notifications go to the named agent only.
        assert dispatcher_for(sender).poll() == 0
    finally:
        dispatcher.unregister(PULLED)
        dispatcher.unregister(NOTIFICATION_PREFIX.encode())
        sender.remove_remote_agent(receiver_name)
