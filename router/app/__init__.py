"""The public handler: a request's session and decision, then a forward or the
router's own answer (design §1).
"""
