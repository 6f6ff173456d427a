"""The live run page's feed: the WebSocket consumer and its routing, the streams it reads rows
back with, and the origin check; it wakes on the doorbell (dashboard/doorbell.py) the writers ring."""
