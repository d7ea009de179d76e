"""`make demo`: generate with the target alone and with EAGLE 3.1, show the text is identical, print the speedup."""

print("no demo pair yet")
