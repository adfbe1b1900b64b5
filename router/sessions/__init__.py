"""Session kinds (design §4): which session a request names, the value formats
and where they sit, and the claims learned from replies. Pure: no sockets, no event loop.
"""
