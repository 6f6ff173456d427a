"""The live run page's feed: the WebSocket consumer and its routing, the rows it reads back
(rows/stream.py), and the origin check; it wakes on the doorbell (dashboard/doorbell.py) the writers ring."""
