"""The public HTTP/1.1 server (design §8): client connections, their limits and
clocks, the parser, requests and replies. It never decides where a request goes.
"""
