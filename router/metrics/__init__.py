"""Prometheus exposition (design §6): counts per request and the state read
at scrape time.
"""
