"""One router process (design §3, §6): the wiring of its parts, the admin
listener, health probes, the journal, reloads, spawned workers, signals and logs.
"""
