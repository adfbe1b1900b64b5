"""The forwarding path to workers (design §3, §8): keep-alive pools, connections,
request heads and bodies, and the streamed or whole replies.
"""
