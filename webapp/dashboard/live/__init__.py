"""The live run page's feed: the WebSocket consumer and its routing, the channel-layer doorbell
that wakes it when rows land, the streams it reads them back with, and the origin check."""
