"""The worker side of the control socket (design §3): the client a Python worker
uses, and the boot check middlewares. `router.client` re-exports it.
"""
