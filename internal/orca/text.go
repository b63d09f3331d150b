package orca

import "strings"

// parseText parses the body of a TEXT report: comma-separated
// key=value elements, empty elements skipped as in any HTTP list.
func parseText(body string) (Report, error) {
	b := builder{strict: true}
	for body != "" {
		var elem string
		elem, body, _ = strings.Cut(body, ",")
		elem = strings.Trim(elem, " \t")
		if elem == "" {
			continue
		}
		if err := b.key(); err != nil {
			return Report{}, err
		}
		// '=' is the ORCA form; Envoy's parser splits at ':'. Names
		// may hold ':' but values never do, so without '=' the last
		// ':' is the separator.
		i := strings.IndexByte(elem, '=')
		if i < 0 {
			i = strings.LastIndexByte(elem, ':')
		}
		if i < 0 {
			return Report{}, fault(ErrSyntax, elem, "no '=' between key and value")
		}
		key := strings.TrimRight(elem[:i], " \t")
		val := strings.TrimLeft(elem[i+1:], " \t")
		if err := b.text(key, val); err != nil {
			return Report{}, err
		}
	}
	return b.r, nil
}

// text sets one TEXT key to the value written as val.
func (b *builder) text(key, val string) error {
	if s, ok := scalarFor(key); ok {
		v, err := number(key, val)
		if err != nil {
			return err
		}
		return b.setScalar(s, key, v)
	}
	for m, p := range mapPrefix {
		if name, ok := strings.CutPrefix(key, p+"."); ok {
			v, err := number(key, val)
			if err != nil {
				return err
			}
			return b.setEntry(m, name, v)
		}
	}
	return nil // a key this package does not know: skipped
}
