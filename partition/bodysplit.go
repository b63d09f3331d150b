package partition

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-lbx/lbx/internal/bodysplit"
	"github.com/caddy-lbx/lbx/internal/caddyopt"
)

// Per-part request bodies (split_body): each partition or branch is sent
// only its own elements of an array field of the JSON request body, and a
// part with none is skipped. The split itself is internal/bodysplit.

// provisionSplit writes split_body's defaults and prepares its splitter.
func (h *FanOut) provisionSplit() error {
	if h.SplitBody == nil {
		return nil
	}
	h.SplitBody.SetDefaults()
	s, err := bodysplit.New(*h.SplitBody)
	if err != nil {
		return fmt.Errorf("split_body: %v", err)
	}
	h.splitter = s
	return nil
}

// checkSplitBody is split_body's part of validate.
func (h *FanOut) checkSplitBody() error {
	if h.SplitBody == nil {
		return nil
	}
	c := *h.SplitBody
	c.SetDefaults()
	if err := c.Validate(); err != nil {
		return fmt.Errorf("split_body: %v", err)
	}
	return nil
}

// splitBodies splits body among the n parts (the chosen scheme's
// partitions, or parallel's branches), once per request, before any
// sub-request; bodies is nil without split_body (every part gets body). ok is false when it has answered
// the request itself: 400 for a body that cannot be split.
func (h *FanOut) splitBodies(w http.ResponseWriter, r *http.Request, n int, body []byte) (bodies [][]byte, ok bool) {
	if h.splitter == nil {
		return nil, true
	}
	bodies, err := h.splitter.Split(body, n)
	if err != nil {
		h.answer(w, r, http.StatusBadRequest, "split_body: "+err.Error())
		return nil, false
	}
	return bodies, true
}

// bodyFor returns part i's request body.
func (p subParent) bodyFor(i int) []byte {
	if p.bodies == nil {
		return p.body
	}
	return p.bodies[i]
}

// noBody reports whether split_body left part i without elements:
// it is skipped.
func (p subParent) noBody(i int) bool {
	return p.bodies != nil && p.bodies[i] == nil
}

// bodyBytes is what the request bodies of calls hold, for the fan-out's
// memory reservation: a copy of each sub-request's body, which the
// internal reverse_proxy buffers for retries, and, with split_body, the
// split bodies themselves. Split bodies together are at most the request
// body plus, per partition beyond the first, the bytes of the body
// outside the array (see bodysplit.Splitter.Split).
func (p subParent) bodyBytes(calls []*subCall) int64 {
	if p.bodies == nil {
		return int64(len(calls)) * int64(len(p.body))
	}
	var n int64
	for _, c := range calls {
		n += int64(len(p.bodies[c.index]))
	}
	return 2 * n
}

// splitBody reads `split_body <field> [hash|index] [{ key <member>;
// max_elements <n> }]`, checking each value where it is written.
func (p *blockParse) splitBody(d *caddyfile.Dispenser, name string) error {
	what := p.what + ": " + name
	args := d.RemainingArgs()
	switch {
	case len(args) == 0:
		return caddyopt.Missing(d, p.what)
	case len(args) > 2:
		return caddyopt.Errf(d, what, "want <field> [hash|index], got %d arguments", len(args))
	}
	c := &bodysplit.Config{Field: args[0]}
	if err := caddyopt.Checked(d, what, bodysplit.CheckField(c.Field)); err != nil {
		return err
	}
	by := bodysplit.ByHash // the default, written into by by Provision
	if len(args) == 2 {
		by, c.By = args[1], args[1]
		if err := caddyopt.Checked(d, what, bodysplit.CheckBy(by)); err != nil {
			return err
		}
	}
	err := caddyopt.Options(d, what, func(opt string) error {
		switch opt {
		case "key":
			v, err := caddyopt.OneArg(d, what)
			if err != nil {
				return err
			}
			c.Key = v
			return caddyopt.Checked(d, what, bodysplit.CheckKey(by, v))
		case "max_elements":
			n, err := caddyopt.Int(d, what)
			if err != nil {
				return err
			}
			c.MaxElements = n
			return caddyopt.Checked(d, what, bodysplit.CheckMaxElements(n))
		}
		return caddyopt.Unknown(d, what, "key", "max_elements")
	})
	if err != nil {
		return err
	}
	p.f.SplitBody = c
	return nil
}
