"""The wire contracts the router and its workers share (design §3): the control
protocol's lines, versions and limits, the grammar of worker and control addresses, and
the boot header. Pure: no sockets, no event loop; imported by both sides.
"""
