"""Ray lives here and nowhere else: the session, the actors and the round loop."""
