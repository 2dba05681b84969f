"""One sync: the selector, bucket planning, the sender, the session, the controller and its lease."""
