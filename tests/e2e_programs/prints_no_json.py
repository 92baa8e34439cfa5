"""A broken end-to-end program: it runs, but reports its number as prose."""

print("starting")
print("forward took 12.5 ms")
