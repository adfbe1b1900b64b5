"""The control socket (design §3): a connection's session rules (pure) and the
listening server and connections (asyncio).
"""
