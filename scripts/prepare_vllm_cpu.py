#!/usr/bin/env python3
"""placeholder: install step only"""
