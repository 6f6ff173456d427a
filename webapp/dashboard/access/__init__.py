"""Who may do what, and how much: the checks a write passes before the actions layer runs it --
input validation, ownership and per-user limits (policy), and login and request throttling."""
