"""The router's core (design §1, §3): the claim table, the worker registry and the
state machine that decides where a request goes. Pure: no I/O; `now` is passed in.
"""
