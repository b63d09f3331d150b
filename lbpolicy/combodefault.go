package lbpolicy

import (
	"encoding/json"
	"fmt"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The selection policy lbx's combo handlers give the reverse_proxy
// handlers of theirs that name none.

// DefaultComboPolicy returns the selection policy, as module JSON, that
// lbx's combo handlers give a reverse_proxy of theirs that names none
// (partition's proxy, a selective group's): least_time, which judges
// replicas by what they answered and reads the replicas a call already
// tried. Caddy's own default, random, does neither. It is written under
// the earlier name, ewma, which behaves the same, so that configs adapted
// before the rename and their admin views and metrics read as they did.
// A new copy each call: it is stored into configs.
func DefaultComboPolicy() json.RawMessage { return json.RawMessage(`{"policy":"ewma"}`) }

// DefaultRoutesPolicy gives each reverse_proxy in routes (and in their
// subroutes) that names no selection policy DefaultComboPolicy, in its
// raw JSON before it is provisioned: the routes of a selective group or
// a parallel branch, where a retry or a backup in the same routes must go
// to another replica, and the replicas are judged by what they answered.
// Nested selective, partition and parallel handlers choose their own
// defaults.
func DefaultRoutesPolicy(routes caddyhttp.RouteList) error {
	for i := range routes {
		for j, raw := range routes[i].HandlersRaw {
			out, err := defaultHandlerPolicy(raw)
			if err != nil {
				return fmt.Errorf("route %d, handler %d: %v", i, j, err)
			}
			routes[i].HandlersRaw[j] = out
		}
	}
	return nil
}

// defaultHandlerPolicy returns raw, a handler's JSON, with
// DefaultComboPolicy written in if it is a reverse_proxy with no selection
// policy, or a subroute holding one.
func defaultHandlerPolicy(raw json.RawMessage) (json.RawMessage, error) {
	var h map[string]json.RawMessage
	if err := json.Unmarshal(raw, &h); err != nil {
		return nil, err
	}
	var name string
	if err := json.Unmarshal(h["handler"], &name); err != nil {
		return raw, nil // Caddy's provisioning reports it
	}
	switch name {
	case "reverse_proxy":
		var lb map[string]json.RawMessage
		if v, ok := h["load_balancing"]; ok {
			if err := json.Unmarshal(v, &lb); err != nil {
				return nil, fmt.Errorf("load_balancing: %v", err)
			}
		}
		if p, ok := lb["selection_policy"]; ok && len(p) > 0 && string(p) != "null" {
			return raw, nil
		}
		if lb == nil {
			lb = map[string]json.RawMessage{}
		}
		lb["selection_policy"] = DefaultComboPolicy()
		v, err := json.Marshal(lb)
		if err != nil {
			return nil, err
		}
		h["load_balancing"] = v
	case "subroute":
		var routes caddyhttp.RouteList
		if v, ok := h["routes"]; ok {
			if err := json.Unmarshal(v, &routes); err != nil {
				return nil, fmt.Errorf("subroute routes: %v", err)
			}
		}
		if err := DefaultRoutesPolicy(routes); err != nil {
			return nil, fmt.Errorf("subroute: %v", err)
		}
		v, err := json.Marshal(routes)
		if err != nil {
			return nil, err
		}
		h["routes"] = v
	default:
		return raw, nil
	}
	return json.Marshal(h)
}
