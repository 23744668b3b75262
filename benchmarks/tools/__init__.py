"""Tools around the benchmarks and the suite: mutation testing (mutation.sh), a new user's first hour (first_hour.sh),
a throttled `cat` standing in for a slow filesystem (throttled_cat.py)."""
