"""The generation protocol's shared vocabulary, below both sides that speak it.

``control``: the messages between a worker and its agent on the control channel (one pydantic model
per ``op``, and the replies); ``phases``: a node's phases in a generation and the transitions the
state table allows, the worker's exit code after a checkpoint-based switch. The agent
(:mod:`etc_agent.agent`) and the worker (:mod:`etc_agent.worker`) both import these; neither
imports the other.
"""
